"""Helpers shared by the tests and the benchmarks: ports, moto S3, databases, tiny random models."""

"""The pure core: routing, planning, policies and the worker protocol, as functions and state machines.

Imports only the standard library, ``msgspec`` (plain data), ``kvrelay.protocol`` and ``kvrelay.core``
(enforced by ``tests/unit/test_layering.py``).
"""

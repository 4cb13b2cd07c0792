"""The cluster faces as processes: ``kvrelay router``, ``kvrelay worker`` and ``kvrelay cluster``."""

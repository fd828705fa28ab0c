"""Private mechanisms shared by every capability: clocks, processes, stores, IPC, shared memory.

Imports only the standard library, torch and psutil; never a capability subpackage.
"""

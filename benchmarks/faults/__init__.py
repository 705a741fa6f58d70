"""Worker scripts for the fault-injection benchmark (``benchmarks/fault_injection.py``)."""

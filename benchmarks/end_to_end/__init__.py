"""End to end on the shaped testbed: the GPT example tuned by distune against the oracle, the
default group and torch DDP. Run ``python -m benchmarks.end_to_end`` (root needed); modules:
``oracle`` (the interleaved measurement of every variant, run in every rank), ``analysis`` (the
ratios, the tuning cost, the lower bound, the plot)."""

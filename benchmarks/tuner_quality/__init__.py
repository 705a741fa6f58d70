"""Tuner quality on synthetic landscapes: how many samples each tuner needs to find a group
within 2% of the best, with realistic measurement noise. Run ``python -m
benchmarks.tuner_quality``; the modules are ``landscapes`` (true throughput tables),
``measurement`` (the noise), ``tuners`` (distune's session and the baselines) and ``compare``
(the runs and the tables). No torch, no processes."""

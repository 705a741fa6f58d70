"""Level 2's search against other policies, on one exhaustive grid of real trials.

``grid`` measures every configuration of a job's level-2 space as real trials (the profile
first, as level 2 runs it); ``policies`` replays distune's search, a DeepSpeed-style policy and
the seed's hand-tuning policy against that one table, so all of them see the same measurements
and differ only in which trials they run and what they choose.
"""

"""Level 2's trial search: which configurations of micro-batch, ZeRO stage and activation
checkpointing to run as short trials, and which one wins.

Torch-free, like the rest of the service: ``trial_config`` (a configuration, the user's pins,
the config keys as DeepSpeed names them), ``trial_space`` (the candidates under the global-batch
constraint), ``memory_model`` (predicted peak bytes per rank, corrected by measurements),
``trial_result`` (what a finished trial reports) and ``trial_search`` (the policy).
"""

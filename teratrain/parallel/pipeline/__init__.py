"""Pipeline parallelism: schedules as data (actions.py, schedules.py), one simulator (simulate.py),
layer partitioning (partition.py), timeline pictures (plot.py); and the parts that run them: the
split of the model (split.py, stage.py), the executor (runtime.py) with its transport (p2p.py),
ZB-H1's split backward (backward.py) and what it keeps between its halves (saved.py), weight
versions (versions.py) and measured timelines (timing.py)."""

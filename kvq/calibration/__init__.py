"""Static KV scales: measuring them (`kvq calibrate`) and loading them (`--kv-scales`, checkpoints)."""

#: Observers of :func:`kvq.calibration.scales.scales_from_stats` (here: the CLI lists them without torch).
OBSERVERS = ("absmax", "mse")

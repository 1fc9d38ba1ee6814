"""Static KV scales: measuring them (`kvq calibrate`) and loading them (`--kv-scales`)."""

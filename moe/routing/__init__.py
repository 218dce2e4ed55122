"""Routing replay: trace format and validation (trace), engine decoders (decoders), transport to the
ranks that need each piece (transport), megatron RouterReplay driving (replay), metrics (metrics)."""

"""Tools above the engine: they drive an LLM to fit what the low layers read (calibration)."""

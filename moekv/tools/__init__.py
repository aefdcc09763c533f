"""Tools above the engine: they drive an LLM over text and write files the engine reads."""

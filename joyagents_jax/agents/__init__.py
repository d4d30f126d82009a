"""The multi-agent system: the text protocol, safe tools, roles and episodes."""

"""The tiers that hold and step subgroups' optimizer state: `host` (worker process)."""

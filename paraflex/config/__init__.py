"""paraflex.config: the config file (YAML/JSON) -> validated, resolved Config dataclasses."""

"""Model implementations and the ``model_type`` registry."""

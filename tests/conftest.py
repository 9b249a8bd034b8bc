"""Shared pytest fixtures. Heavy fixtures (a Ray session, built checkpoints) live here so the
whole session shares one instance."""

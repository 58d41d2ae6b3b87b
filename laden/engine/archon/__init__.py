"""The `archon` engine (issue [10]): pipeline parallel first (`laden.engine.archon.pipeline`)."""

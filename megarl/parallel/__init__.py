"""Parallel layouts and their process groups."""

from megarl.parallel.layout import Layout, LayoutError, ParallelGroups, build_groups, build_placed_groups

__all__ = ["Layout", "LayoutError", "ParallelGroups", "build_groups", "build_placed_groups"]

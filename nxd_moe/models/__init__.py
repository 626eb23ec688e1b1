"""Whole-model integration: transformers models built, patched and traced around this package's MoE layers."""

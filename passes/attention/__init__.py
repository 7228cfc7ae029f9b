"""Passes and helpers on attention: constant masks made flags (masks), written-out attention found as SDPA, grouped kv
heads read in place (gqa)."""

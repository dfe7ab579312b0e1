# SPDX-License-Identifier: Apache-2.0
"""Tooling and benchmarks for the DSA indexer patch series."""

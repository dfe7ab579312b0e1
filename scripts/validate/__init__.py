# SPDX-License-Identifier: Apache-2.0
"""The MI355X validation kit: serve a model with each stage's baseline and
configurations, run the PR texts' benchmark sweep and accuracy tasks against
it, check every result the way the PR texts' authors did, and keep every raw
file.

``python3 -m scripts.validate --stage 0001 [--dry-run]``; the matrix is
``seeds.toml`` (the PR texts' models, flags, ISLs and concurrencies) unless
``--config`` names another file of the same form. Each variant's code (the
stages up to one, or none) is installed into the machine's vLLM before its
server starts, with the series tool's ``install``. It needs the GPUs and that
vLLM; nothing here runs a model on a CPU machine.
"""

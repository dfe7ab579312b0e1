# SPDX-License-Identifier: Apache-2.0
"""The MI355X validation kit: serve a model with each stage's baseline and
configurations, run the seeds' benchmark sweep and accuracy tasks against it,
check every result the way the seeds did, and keep every raw file.

``python -m scripts.validate --stage 0001 [--dry-run]``; the matrix is
``seeds.toml`` (the seeds' models, flags, ISLs and concurrencies) unless
``--config`` names another file of the same form. It needs the GPUs and the
installed patched vLLM; nothing here runs a model on a CPU machine.
"""

# SPDX-License-Identifier: Apache-2.0
"""Writing the stages into an installed vLLM, and undoing it."""

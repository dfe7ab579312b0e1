# SPDX-License-Identifier: Apache-2.0
"""Rebasing the stages onto a newer vLLM, ending on a project branch."""

# SPDX-License-Identifier: Apache-2.0
"""The pytest runs that test the stages' trees, and their results."""

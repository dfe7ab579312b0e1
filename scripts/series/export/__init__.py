# SPDX-License-Identifier: Apache-2.0
"""The stages as upstream PRs, checked as a maintainer takes them."""

# SPDX-License-Identifier: Apache-2.0
"""The stage commits: fetch and prepare the base, apply the stages,
write them back to patches/ (refresh) and check them."""

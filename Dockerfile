# SPDX-License-Identifier: Apache-2.0
# vLLM's published ROCm image with the DSA indexer stages written into its
# vLLM (README.md, "Serve it on an MI355X"):
#
#   docker build -t dsa-vllm:0.34.0 .
#   docker build --build-arg INSTALL_ARGS="--stages 0001,0004" -t dsa-vllm:0.34.0-0001 .
#
# (--stages 0001,0004 installs stage 0001 and the fix 0004, without 0003;
# --upto 0001 installs stage 0001 alone; install's output names the stages
# left out.)
#
# The tag is the vLLM release the series is pinned to (patches/series.toml;
# a rebase's branch moves it with the pin); install refuses any other vLLM. The build downloads that release's sdist
# from PyPI (checked against its sha256) to make the stage commits, so it
# needs network access and git (installed if the image lacks it).
FROM vllm/vllm-openai-rocm:v0.34.0

# Passed on to install: empty for every stage, "--stages ..." or "--upto ..."
# for fewer.
ARG INSTALL_ARGS=""

# Before the project is copied in: an edit of the project reuses this layer.
RUN command -v git >/dev/null || (apt-get update \
    && apt-get install -y --no-install-recommends git \
    && rm -rf /var/lib/apt/lists/*)
COPY . /opt/dsa-series
WORKDIR /opt/dsa-series
# Every change the stages make is Python, so the image's compiled vLLM stays.
# The work repo and the sdist go once the stages are written; the project
# stays in /opt/dsa-series for install --undo and the gfx950 tests.
RUN python3 -m scripts.series apply \
    && python3 -m scripts.series install $INSTALL_ARGS --into "$(python3 -c \
        'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("vllm").origin).parents[1])')" \
    && rm -rf build "$HOME/.cache/dsa-indexer-series"
WORKDIR /

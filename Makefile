# The README's two commands are `make run` and `make test`; both install first.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 is the CPU build on this kind of machine's disk; any torch already in the venv is kept.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install browser test test-fast lint run clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# The main job: the embedded MLP example on 2 CPU ranks, tuned online, in about a minute.
run: install
	$(VENV)/bin/distune-run --nproc_per_node 2 --autotune_level 1 \
		--autotune_warmup_time 2 --autotune_sampling_confidence_time 2 --is_output_autotune_log \
		examples/train_mlp.py --seconds 90

# The dashboard's browser test drives Debian's chromium through chromedriver. Installed here when
# this runs as root with apt-get; elsewhere that test skips and says why.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver for the dashboard's browser test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-liberation \
			>/dev/null) \
		|| echo "could not install chromium: the dashboard's browser test will skip"; \
	else echo "no chromium and no root apt-get: the dashboard's browser test will skip"; fi

# Fails on any of: ruff's rules (import rules and complexity included), ruff's formatting,
# mypy on src/.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint browser
	$(VENV)/bin/pytest -n 2 --dist loadgroup

test-fast: lint
	$(VENV)/bin/pytest -m "not slow"

clean:
	rm -rf $(VENV) build src/*.egg-info

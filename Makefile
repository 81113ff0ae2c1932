# The two commands of the README. Both set up .venv first (idempotent).
.PHONY: serve test test-all bootstrap

bootstrap:
	@./scripts/bootstrap.sh

# Router + prefill worker + decode worker on the embedded tiny checkpoint, on this CPU.
serve: bootstrap
	@.venv/bin/tandem serve $(ARGS)

# Everything CI runs (GPU tests are marked and deselected; they run through the device tool), on TEST_WORKERS
# pytest-xdist processes (TEST_WORKERS=0: one process, in order).
TEST_WORKERS ?= 2
test: bootstrap
	@.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(ARGS)

# Thin wrapper over ./dev, which needs only bash and Python 3.11.
.PHONY: setup demo test bench
setup: ; ./dev setup
demo: ; ./dev demo
test: ; ./dev test
bench: ; ./dev bench

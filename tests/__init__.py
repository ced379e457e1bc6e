"""The tests: unit/ (the fast tier), e2e/ (processes, the notebook, the real model; marked `e2e` by
e2e/conftest.py) and helpers/ (what both import). A package, so that every test module imports
`tests.helpers` by the same name, with or without pytest-xdist."""

"""This repository's tests: a regular package, so that ``from tests.x import``
(pytest's collection and the engine subprocesses alike) finds these files even
where another ``tests`` package is installed."""

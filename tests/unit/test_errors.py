"""Every exception distune defines derives from DistuneError, and each shared one is defined once."""

import importlib
import inspect
import pkgutil

import distune
from distune.errors import ConfigError, DistuneError, ServiceError


def _distune_modules():
    for info in pkgutil.walk_packages(distune.__path__, prefix="distune."):
        # `distune.run` and `__main__` modules are entry points that act when imported.
        if info.name == "distune.run" or info.name.endswith("__main__"):
            continue
        yield importlib.import_module(info.name)


def _exception_classes():
    for module in _distune_modules():
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == module.__name__:
                yield value


def test_every_distune_exception_derives_from_distune_error():
    classes = set(_exception_classes())
    assert len(classes) >= 15, sorted(c.__qualname__ for c in classes)
    strays = sorted(
        f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, DistuneError)
    )
    assert strays == []


def test_shared_errors_are_defined_once():
    names = [c.__name__ for c in _exception_classes()]
    for shared in (ConfigError, ServiceError):
        assert names.count(shared.__name__) == 1, shared
    from distune.cli.service_client import ServiceError as CliServiceError
    from distune.launcher.config_file import ConfigError as FileConfigError
    from distune.tuning_service.config import ConfigError as TuningConfigError
    from distune.worker_runtime.leader_client import ServiceError as WorkerServiceError

    assert CliServiceError is WorkerServiceError is ServiceError
    assert FileConfigError is TuningConfigError is ConfigError


def test_bad_values_stay_value_errors():
    # Code written against the builtin classes keeps catching them.
    from distune.launcher.options import OptionError
    from distune.space import HyperparameterError
    from distune.tuning_service.messages import RequestError

    for error in (ConfigError, OptionError, HyperparameterError, RequestError):
        assert issubclass(error, ValueError)

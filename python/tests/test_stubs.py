"""The native module's type stubs (python/saver/_saver.pyi) are the module's own: every function,
class and method the module has is in them and every one in them is in the module, with the
same parameters, so that an editor's and a type checker's view of it is never stale."""

import ast
import importlib
import inspect
import os

# The native module itself (the package's `saver._saver` name is its guarded wrapper).
_saver = importlib.import_module("saver._saver")

STUBS = os.path.join(os.path.dirname(_saver.__file__), "_saver.pyi")


def _params(node):
    """A stub function's parameter names, `self` left out."""
    a = node.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg != "self"]


def _native_params(call):
    return [n for n in inspect.signature(call).parameters if n != "self"]


def _public(names):
    return {n for n in names if not n.startswith("_")}


def test_the_stubs_name_every_function_class_and_method_of_the_module_with_its_parameters():
    tree = ast.parse(open(STUBS).read())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    module = {n for n in _public(dir(_saver)) if callable(getattr(_saver, n))}
    assert module == set(functions) | set(classes), (
        f"in the module, not the stubs: {sorted(module - set(functions) - set(classes))}; "
        f"in the stubs, not the module: {sorted(set(functions) | set(classes) - module)}"
    )
    for name, node in functions.items():
        assert _params(node) == _native_params(getattr(_saver, name)), name
    for name, node in classes.items():
        cls = getattr(_saver, name)
        if issubclass(cls, BaseException):
            continue
        stubbed = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
        methods = _public(n for n in vars(cls) if callable(getattr(cls, n)))
        assert methods == _public(stubbed), (
            f"{name}: in the module, not the stubs: {sorted(methods - set(stubbed))}; "
            f"in the stubs, not the module: {sorted(_public(stubbed) - methods)}"
        )
        for method in methods:
            assert _params(stubbed[method]) == _native_params(getattr(cls, method)), f"{name}.{method}"
        if "__init__" in stubbed:
            assert _params(stubbed["__init__"]) == _native_params(cls), f"{name}()"

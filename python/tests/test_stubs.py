"""The shipped .pyi stubs name exactly what the native module has (no drift)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import onceflow
from onceflow import _native

STUB = Path(onceflow.__file__).with_name("_native.pyi")


def _stub_names():
    tree = ast.parse(STUB.read_text())
    top, members = set(), {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            top.add(node.name)
            members[node.name] = {
                n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            } | {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
    return top, members


def test_stub_ships_with_the_package():
    assert STUB.exists()
    assert Path(onceflow.__file__).with_name("py.typed").exists()


def test_module_level_names_match():
    top, _ = _stub_names()
    native = {n for n in dir(_native) if not n.startswith("__")}
    assert top == native, f"only in stub: {top - native}; only in module: {native - top}"


def test_class_members_match():
    _, members = _stub_names()
    for name, stub_members in members.items():
        cls = getattr(_native, name)
        if issubclass(cls, BaseException):
            continue
        native = {
            n
            for n, v in vars(cls).items()
            if not n.startswith("_") and (inspect.isroutine(v) or inspect.isdatadescriptor(v) or isinstance(v, property))
        }
        stub = {n for n in stub_members if not n.startswith("_")}
        assert stub == native, f"{name}: only in stub: {stub - native}; only in module: {native - stub}"


def test_delivery_attempts_is_a_documented_int_property():
    tree = ast.parse(STUB.read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Delivery"]
    [attempts] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "attempts"]
    assert [ast.unparse(d) for d in attempts.decorator_list] == ["property"]
    assert ast.unparse(attempts.returns) == "int"
    assert "onceflow.send_retries" in (ast.get_docstring(attempts) or "")
    assert isinstance(_native.Delivery.attempts, type(_native.Delivery.duplicate)), "a native getter"

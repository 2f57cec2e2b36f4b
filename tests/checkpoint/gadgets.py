"""Hostile pickles for the tests of loading without code: each, if it were executed, creates ``marker``.

Built opcode by opcode (protocol 4: STACK_GLOBAL resolves dotted names through attributes in the
standard unpickler), so the tests need no class of their own that a restricted unpickler would refuse
for the wrong reason."""

from __future__ import annotations

import pickle
import struct

PROTO4 = b"\x80\x04"


def ref(module: str, name: str) -> bytes:
    """Push the global ``module``.``name`` (BINUNICODE twice, STACK_GLOBAL)."""
    return b"".join(b"X" + struct.pack("<I", len(s.encode())) + s.encode() for s in (module, name)) + b"\x93"


def data(obj) -> bytes:
    """Push plain data (protocol 3: bytes without codecs, no frames), as a fragment of a larger pickle."""
    return pickle.dumps(obj, protocol=3)[2:-1]


def reference(module: str, name: str) -> bytes:
    """A pickle that only names a global."""
    return PROTO4 + ref(module, name) + b"."


def call(module: str, name: str, *args) -> bytes:
    """A pickle that calls ``module.name(*args)``."""
    return PROTO4 + ref(module, name) + data(tuple(args)) + b"R."


def code_object_args(source: str) -> tuple:
    """The arguments of ``types.CodeType`` (this Python's order) that rebuild ``compile(source)``."""
    c = compile(source, "<payload>", "exec")
    return (
        c.co_argcount,
        c.co_posonlyargcount,
        c.co_kwonlyargcount,
        c.co_nlocals,
        c.co_stacksize,
        c.co_flags,
        c.co_code,
        c.co_consts,
        c.co_names,
        c.co_varnames,
        c.co_filename,
        c.co_name,
        c.co_qualname,
        c.co_firstlineno,
        c.co_linetable,
        c.co_exceptiontable,
        c.co_freevars,
        c.co_cellvars,
    )


def function_from_code(marker, module: str = "torch.distributed.checkpoint.metadata") -> bytes:
    """Issue 47's exploit: ``types.FunctionType`` and ``types.CodeType`` reached as dotted names of a
    torch.distributed.checkpoint module (``dataclass.__class__``, ``dataclass.__code__.__class__``), a code
    object built from bytes, a function of it called."""
    args = code_object_args(f"open({str(marker)!r}, 'w').close()")
    return (
        PROTO4
        + ref(module, "dataclass.__class__")
        + b"("
        + ref(module, "dataclass.__code__.__class__")
        + data(args)
        + b"R}tR)R."
    )


def gadgets(marker) -> dict[str, bytes]:
    """name -> a pickle that would create ``marker``: the classic reduce gadgets."""
    touch = f"touch {marker}"
    py = f"open({str(marker)!r}, 'w').close()"
    getattr_os_system = (
        PROTO4
        + ref("builtins", "getattr")
        + b"("
        + ref("builtins", "__import__")
        + data(("os",))
        + b"R"
        + data("system")
        + b"tR"
        + data((touch,))
        + b"R."
    )
    return {
        "os.system": call("os", "system", touch),
        "posix.system": call("posix", "system", touch),
        "os.popen": call("os", "popen", touch),
        "subprocess.Popen": call("subprocess", "Popen", ["sh", "-c", touch]),
        "subprocess.check_output": call("subprocess", "check_output", ["sh", "-c", touch]),
        "subprocess.run": call("subprocess", "run", ["sh", "-c", touch]),
        "builtins.eval": call("builtins", "eval", py),
        "builtins.exec": call("builtins", "exec", py),
        "builtins.compile": call("builtins", "compile", py, "x", "exec"),
        "builtins.open": call("builtins", "open", str(marker), "w"),
        "builtins.getattr(__import__('os'), 'system')": getattr_os_system,
        "builtins.__import__": call("builtins", "__import__", "os"),
        "__builtin__.eval (python 2 name)": call("__builtin__", "eval", py),
        "functools.partial(os.system)": PROTO4 + ref("functools", "partial") + b"(" + ref("os", "system") + b"tR.",
        "types.FunctionType": PROTO4 + ref("types", "FunctionType") + b"(" + ref("types", "CodeType") + b"tR.",
        "types.CodeType": call("types", "CodeType", *code_object_args(py)),
        "copyreg._reconstructor": call("copyreg", "_reconstructor", None, None, None),
        "operator.attrgetter": call("operator", "attrgetter", "system"),
        "operator.methodcaller": call("operator", "methodcaller", "system", touch),
        "importlib.import_module": call("importlib", "import_module", "os"),
        "runpy.run_path": call("runpy", "run_path", str(marker)),
        "pickle.loads": call("pickle", "loads", call("os", "system", touch)),
        "marshal.loads": call("marshal", "loads", b""),
        "code.InteractiveInterpreter": call("code", "InteractiveInterpreter"),
        "pdb.run": call("pdb", "run", py),
        "timeit.timeit": call("timeit", "timeit", py, "pass", None, 1),
        "ctypes.CDLL": call("ctypes", "CDLL", None),
        "shutil.rmtree": call("shutil", "rmtree", str(marker)),
        "numpy.load": call("numpy", "load", str(marker), None, True),
        "torch.load": call("torch", "load", str(marker)),
        "torch.storage._load_from_bytes": call("torch.storage", "_load_from_bytes", call("os", "system", touch)),
        "torch._utils._rebuild_tensor_v2": call("torch._utils", "_rebuild_tensor_v2", None, 0, (), (), False, {}),
        "torch._tensor._rebuild_from_type_v2": call("torch._tensor", "_rebuild_from_type_v2", None, None, (), {}),
        "torch._utils._rebuild_parameter": call("torch._utils", "_rebuild_parameter", None, False, {}),
        "torch.serialization.load": call("torch.serialization", "load", str(marker)),
        "torch.hub.load": call("torch.hub", "load", str(marker), "x"),
        "torch.jit.load": call("torch.jit", "load", str(marker)),
        "torch.distributed.checkpoint.filesystem.os.system": call(
            "torch.distributed.checkpoint.filesystem", "os.system", touch
        ),
        "torch.distributed.checkpoint.metadata FunctionType(CodeType(...))()": function_from_code(marker),
        "torch.distributed.checkpoint.filesystem FunctionType(CodeType(...))()": function_from_code(
            marker, "torch.distributed.checkpoint.filesystem"
        ),
    }

"""jupyter-cedana: suspend idle Jupyter kernels (process and GPU memory) to disk and resume
them transparently on the next message."""

from ._version import __version__


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "jupyter-cedana"}]


def _jupyter_server_extension_points() -> list[dict[str, object]]:
    from .server.app import CedanaApp

    return [{"module": "jupyter_cedana", "app": CedanaApp}]


__all__ = ["__version__"]

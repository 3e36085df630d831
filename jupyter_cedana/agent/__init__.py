"""The checkpoint agent: the one privileged part of jupyter-cedana.

A root service on a Unix socket that launches, checkpoints and restores kernels for the
uid that asks (identified by SO_PEERCRED, never by anything the request says). The
server side talks to it through `client.AgentClient` only. See docs/agent.md.
"""

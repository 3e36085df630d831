"""One kernel of the server: the provisioner and what it composes (its state
machine, suspend and resume, its ports, its park record, the kernel at the agent)."""

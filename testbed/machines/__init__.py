"""Machines beyond this one: the inventory, placement of nodes on machines, SSH control, the multi-machine testbed and qemu VMs."""

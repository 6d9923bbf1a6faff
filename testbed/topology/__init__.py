"""What a topology is: the file's schema, its elements, units, the plan of addresses and routes, and the Topology that holds them."""

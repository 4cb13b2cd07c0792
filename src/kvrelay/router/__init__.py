"""The live router: the asyncio interpreter of the router machine (its stack is wired by ``launch.router_stack``)."""

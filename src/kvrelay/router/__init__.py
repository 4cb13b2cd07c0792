"""The live router: the asyncio interpreter of the router machine and the one place its stack is wired."""

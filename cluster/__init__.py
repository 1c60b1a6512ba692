"""disagg.cluster: Ray actors, router, YAML launch and the command line.

Only this package imports ray. Today it holds the demonstration job (`disagg.cluster.demo`);
the Ray actors, router and CLI arrive with the cluster issue.
"""

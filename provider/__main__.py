"""glm-infra's component provider: Cluster and Hosts for programs in other Pulumi languages.

The schema (types glm-infra:index:Cluster, glm-infra:index:Hosts and their Args) is inferred by
Pulumi's component provider host from the type annotations and docstrings of the components and of
glm_infra.args; the components are the ones Python programs use, so resources created through the
package are the same (same types and names) as from Python.
"""

from pulumi.provider.experimental import component_provider_host

import glm_infra
from glm_infra import Cluster, Hosts

# The lower components (Host, Drivers, HostStep, ModelWeights, VllmService, Router, Monitoring) take
# steps of the per-host plan, Python objects: they stay Python-only.
COMPONENTS = [Cluster, Hosts]

if __name__ == "__main__":
    component_provider_host(name="glm-infra", components=COMPONENTS, version=glm_infra.__version__)

"""A one-machine stand-in Kubernetes cluster, because no real kube-apiserver installs here (README.md
says what was tried): an API server speaking the Kubernetes REST protocol to the real `kubernetes`
client (`apiserver.py`), the controllers of kube-controller-manager and JobSet that our jobs need
(`controllers.py`), and a node agent that runs each pod's container command as a local process in its
own mount and UTS namespaces, like a kubelet without a container runtime (`node.py`). `cluster.py`
starts the three and writes a kubeconfig; `start.sh` / `stop.sh` run it in the background."""

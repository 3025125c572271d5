"""More than one machine: justllm's engine, OpenAI API and routing policy as Ray Serve
deployments (``justllm cluster``). Ray places replicas on nodes, restarts and health-checks
them and autoscales; justllm brings what runs inside them.

Pure modules (no ``ray``): ``options`` (models.yaml -> deployment options), ``asgi`` (one
request through an ASGI app in this process), ``host`` (a replica's engine, app and stats),
``metrics`` (the ingress's /metrics page), ``local_ray`` (the Ray head `justllm cluster`
starts on this machine). Ray modules, imported only when a command needs them: ``router``
(the RequestRouter), ``deployments`` (model replica, ingress, stats board) and ``deploy``
(connect, deploy, status, down).
"""

{{/*
The prefill and decode workers are one template given the role: prefill-deployment.yaml and
decode-deployment.yaml (and the two Services) only call these with "prefill" or "decode".
Args everywhere: dict "root" $ "role" "prefill"|"decode".
*/}}

{{/* Parallelism rules the schema cannot express across fields. */}}
{{- define "tandem.worker.validate" -}}
{{- $p := .spec.parallelism }}
{{- if and (eq $p.moeMode "tp") (ne (int $p.expert) 1) }}
{{- fail (printf "%s.parallelism: moeMode tp shards every expert over the TP ranks, so expert must be 1 (got %v)" .component $p.expert) }}
{{- end }}
{{- if and (eq $p.moeMode "ep") (ne (int $p.expert) (int $p.tensor)) }}
{{- fail (printf "%s.parallelism: moeMode ep places experts on the TP ranks, so expert must equal tensor (got expert %v, tensor %v)" .component $p.expert $p.tensor) }}
{{- end }}
{{- if and (eq .component "prefill") (ne $p.moeMode "tp") }}
{{- fail "prefill.parallelism.moeMode must be tp: prefill runs TP-only MoE" }}
{{- end }}
{{- $pk := .root.Values.prefill.kvCache }}
{{- $dk := .root.Values.decode.kvCache }}
{{- if or (ne $pk.dtype $dk.dtype) (ne (int $pk.scaleCalibration) (int $dk.scaleCalibration)) }}
{{- fail (printf "prefill.kvCache and decode.kvCache must be equal (got %v/%v and %v/%v): prefill writes its pages into decode's, and the KV handshake refuses peers whose KV dtype or FP8 scales differ" $pk.dtype $pk.scaleCalibration $dk.dtype $dk.scaleCalibration) }}
{{- end }}
{{- end }}

{{/* Command-line flags of `tandem prefill-worker` / `tandem decode-worker`. */}}
{{- define "tandem.worker.args" -}}
{{- $w := .spec }}
{{- $v := .root.Values }}
- {{ printf "%s-worker" .component }}
- --checkpoint={{ printf "%s/%s" $v.model.mountPath $v.model.path }}
- --tp={{ $w.parallelism.tensor }}
{{- if eq .component "decode" }}
- --moe-mode={{ $w.parallelism.moeMode }}
{{- end }}
- --host=0.0.0.0
- --advertise-host=$(POD_IP)
- --port={{ $w.port }}
- --metrics-port={{ $w.metricsPort }}
- --kv-backend=nixl
- --device=cuda
- --drain-timeout-s={{ $v.drain.timeoutSeconds }}
{{- if $w.fp8 }}
- --fp8
{{- end }}
- --kv-cache-dtype={{ $w.kvCache.dtype }}
{{- if gt (int $w.kvCache.scaleCalibration) 0 }}
- --kv-scale-calibration={{ $w.kvCache.scaleCalibration }}
{{- end }}
{{- if eq .component "decode" }}
- --max-num-seqs={{ $w.engine.maxNumSeqs }}
- --kv-cache-fraction={{ $w.engine.kvCacheFraction }}
- {{ ternary "--cuda-graphs" "--no-cuda-graphs" $w.engine.cudaGraphs }}
{{- end }}
{{- if not $w.piecewiseGraphs }}
- --no-piecewise-graphs
{{- end }}
{{- range $w.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* requests/limits: the values' resources plus GPUs (= TP ranks) and RDMA devices. */}}
{{- define "tandem.worker.resources" -}}
{{- $w := .spec }}
{{- $extra := dict .root.Values.accelerator.resourceName (int $w.parallelism.tensor) }}
{{- if gt (int $w.nixl.rdma.count) 0 }}
{{- $_ := set $extra $w.nixl.rdma.resourceName (int $w.nixl.rdma.count) }}
{{- end }}
requests:
  {{- toYaml (merge (deepCopy $extra) (default (dict) $w.resources.requests)) | nindent 2 }}
limits:
  {{- toYaml (merge (deepCopy $extra) (default (dict) $w.resources.limits)) | nindent 2 }}
{{- end }}

{{- define "tandem.workerDeployment" -}}
{{- $root := .root }}
{{- $w := index $root.Values .role }}
{{- $ctx := dict "root" $root "component" .role "spec" $w }}
{{- include "tandem.worker.validate" $ctx }}
{{- $model := $root.Values.model }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "tandem.componentName" $ctx }}
  labels:
    {{- include "tandem.labels" $ctx | nindent 4 }}
spec:
  {{- if not $root.Values.autoscaler.enabled }}
  replicas: {{ $w.replicas }}
  {{- end }}
  # GPUs are normally fully booked: replace pods in place instead of surging.
  strategy:
    type: RollingUpdate
    rollingUpdate: {maxSurge: 0, maxUnavailable: 1}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tandem.podLabels" $ctx | nindent 8 }}
      {{- with $w.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      # Drain on SIGTERM: /ready turns 503, in-flight requests get drain.timeoutSeconds to finish,
      # the rest end with "abort", then the process exits; Kubernetes waits that plus a margin.
      terminationGracePeriodSeconds: {{ add $root.Values.drain.timeoutSeconds $root.Values.drain.marginSeconds }}
      enableServiceLinks: false
      {{- with include "tandem.scheduling" $ctx | trim }}{{ . | nindent 6 }}{{ end }}
      containers:
        - name: {{ .role }}
          image: {{ include "tandem.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["tandem"]
          args:
            {{- include "tandem.worker.args" $ctx | trim | nindent 12 }}
          ports:
            - {name: rpc, containerPort: {{ $w.port }}, protocol: TCP}
            - {name: metrics, containerPort: {{ $w.metricsPort }}, protocol: TCP}
          env:
            # Peers (the KV side channel) must reach this pod's own address, not 0.0.0.0.
            - name: POD_IP
              valueFrom: {fieldRef: {fieldPath: status.podIP}}
            - {name: UCX_TLS, value: {{ $w.nixl.ucxTls | quote }}}
            {{- with $w.nixl.ucxNetDevices }}
            - {name: UCX_NET_DEVICES, value: {{ . | quote }}}
            {{- end }}
            {{- with $w.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            {{- include "tandem.worker.resources" $ctx | trim | nindent 12 }}
          {{- include "tandem.probes" (dict "probes" $w.probes "port" "metrics") | nindent 10 }}
          {{- if $w.nixl.ipcLock }}
          securityContext:
            capabilities: {add: [IPC_LOCK]}
          {{- end }}
          volumeMounts:
            - {name: model, mountPath: {{ $model.mountPath }}, readOnly: true}
            - {name: dshm, mountPath: /dev/shm}
      volumes:
        - name: model
          {{- if eq $model.volume.type "pvc" }}
          persistentVolumeClaim: {claimName: {{ required "model.volume.claimName is required when model.volume.type is pvc" $model.volume.claimName }}, readOnly: true}
          {{- else }}
          hostPath: {path: {{ $model.volume.hostPath }}, type: Directory}
          {{- end }}
        - name: dshm
          emptyDir: {medium: Memory, sizeLimit: {{ $w.nixl.shmSizeLimit }}}
{{- end }}

{{/* Headless Service: one DNS record / endpoint per ready worker, for the router's discovery. */}}
{{- define "tandem.workerService" -}}
{{- $w := index .root.Values .role }}
{{- $ctx := dict "root" .root "component" .role "spec" $w }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "tandem.componentName" $ctx }}
  labels:
    {{- include "tandem.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "tandem.selectorLabels" $ctx | nindent 4 }}
  ports:
    - {name: rpc, port: {{ $w.port }}, targetPort: rpc, protocol: TCP}
    - {name: metrics, port: {{ $w.metricsPort }}, targetPort: metrics, protocol: TCP}
{{- end }}

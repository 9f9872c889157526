{{- define "warmroute.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "warmroute.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/part-of: warmroute
{{- end -}}

{{- define "warmroute.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "warmroute.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* Several brains: the gateway shape with more than one picker; they share state through Redis */}}
{{- define "warmroute.several" -}}
{{- if gt (int .Values.brain.replicas) 1 }}true{{ end -}}
{{- end -}}

{{- define "warmroute.redisUrl" -}}
{{- if .Values.sharedState.inChartRedis -}}
redis://{{ include "warmroute.fullname" . }}-redis:6379/0
{{- else -}}
{{ .Values.sharedState.redisUrl }}
{{- end -}}
{{- end -}}

{{- define "warmroute.k8sDiscovery" -}}
{{- if or (eq .Values.shape "gateway") (eq .Values.modelServers.discovery "kubernetes") }}true{{ end -}}
{{- end -}}

{{/* The brain's config: what the shape needs (ports, TLS files, discovery, shared state), then .Values.config over
it. The same file Envoy's bootstrap is rendered from in the standalone shape (warmroute envoy-config). */}}
{{- define "warmroute.config" -}}
{{- $name := include "warmroute.fullname" . -}}
{{- $brain := dict "protocol" "endpoint-picker" "grpc_port" 9002 "grpc_socket" nil "metrics_host" "0.0.0.0" "metrics_port" 9102 "admin_token_file" "/tmp/warmroute/admin.token" "response_key_file" "/tmp/warmroute/response.key" -}}
{{- if eq .Values.shape "standalone" -}}
{{- $_ := set $brain "host" $name -}}
{{- else -}}
{{- $_ := set $brain "host" "0.0.0.0" -}}
{{- end -}}
{{- if .Values.tls.enabled -}}
{{- $_ := set $brain "tls_cert_file" "/etc/warmroute/tls/tls.crt" -}}
{{- $_ := set $brain "tls_key_file" "/etc/warmroute/tls/tls.key" -}}
{{- else -}}
{{- $_ := set $brain "insecure" true -}}
{{- end -}}
{{- $cfg := dict "brain" $brain -}}
{{- if eq .Values.shape "gateway" -}}
{{- $_ := set $cfg "discovery" (dict "source" "kubernetes" "inference_pool" .Values.inferencePool.name "interval_s" 30) -}}
{{- else -}}
{{- $_ := set $cfg "replicas" list -}}
{{- if eq .Values.modelServers.discovery "kubernetes" -}}
{{- $_ := set $cfg "discovery" (dict "source" "kubernetes" "service" (printf "%s-model-servers" $name) "port" (int .Values.modelServers.port) "interval_s" 5) -}}
{{- else -}}
{{- $_ := set $cfg "discovery" (dict "source" "dns" "dns_name" (printf "%s-model-servers" $name) "port" (int .Values.modelServers.port) "interval_s" 5) -}}
{{- end -}}
{{- $envoy := dict "listen_host" "0.0.0.0" "listen_port" 8080 "admin_path" "/run/warmroute/envoy-admin.sock" "stats_host" "0.0.0.0" "stats_port" 9901 -}}
{{- if .Values.tls.enabled -}}
{{- $_ := set $envoy "brain_tls_ca_file" "/etc/envoy/tls/ca.crt" -}}
{{- $_ := set $envoy "brain_tls_sni" $name -}}
{{- end -}}
{{- $_ := set $cfg "envoy" $envoy -}}
{{- end -}}
{{- with .Values.exactMode -}}
{{- if .tokenizers -}}
{{- $tok := dict -}}
{{- range $i, $t := .tokenizers -}}
{{- $_ := set $tok $t.model (printf "/etc/warmroute/tokenizers/%d" $i) -}}
{{- end -}}
{{- $_ := set $cfg "exact_cache" (dict "tokenizers" $tok) -}}
{{- end -}}
{{- if .kvEventsPort -}}
{{- $d := $cfg.discovery -}}
{{- $_ := set $d "kv_events_port" (int .kvEventsPort) -}}
{{- if .kvEventsReplayPort -}}
{{- $_ := set $d "kv_events_replay_port" (int .kvEventsReplayPort) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if include "warmroute.several" . -}}
{{- $_ := set $cfg "shared_state" (dict "redis_url" (include "warmroute.redisUrl" .) "password_file" "/etc/warmroute/redis/password" "secret_file" "/etc/warmroute/redis/secret") -}}
{{- end -}}
{{- toYaml (mergeOverwrite $cfg (deepCopy .Values.config)) -}}
{{- end -}}

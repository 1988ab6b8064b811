{{/* Names and labels. */}}
{{- define "narwhal.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "narwhal.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "narwhal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "narwhal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "narwhal.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "narwhal.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "narwhal.headless" -}}
{{- printf "%s-pods" (include "narwhal.fullname" .) -}}
{{- end -}}

{{- define "narwhal.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "narwhal.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "narwhal.adminSecretName" -}}
{{- default (printf "%s-admin" (include "narwhal.fullname" .)) .Values.adminToken.existingSecret -}}
{{- end -}}

{{/* The lease backend: none, file or etcd (Narwhal's own default is file when a lease section is given). */}}
{{- define "narwhal.leaseBackend" -}}
{{- $cfg := .Values.config | default dict -}}
{{- if hasKey $cfg "lease" -}}{{- get (get $cfg "lease" | default dict) "backend" | default "file" -}}{{- else -}}none{{- end -}}
{{- end -}}

{{/* Two routers (active and warm standby) with the etcd lease; one otherwise. */}}
{{- define "narwhal.replicas" -}}
{{- if eq (include "narwhal.leaseBackend" .) "etcd" -}}2{{- else -}}1{{- end -}}
{{- end -}}

{{/*
The narwhal YAML of one router, as a dict. Call with (dict "root" $ "ordinal" N).
Checks the values first and fails with a message naming the value at fault.
*/}}
{{- define "narwhal.routerConfig" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $full := include "narwhal.fullname" $root -}}
{{- $replicas := int (include "narwhal.replicas" $root) -}}
{{- $cfg := deepCopy ($v.config | default dict) -}}
{{- range $key := list "router_id" "listen" "model" "engines" "discovery" "admin" -}}
{{- if hasKey $cfg $key -}}
{{- fail (printf "config.%s is set by the chart; use the chart value instead (values.yaml says which)" $key) -}}
{{- end -}}
{{- end -}}
{{- if not $v.model -}}
{{- fail "model is required: the model name clients send and the engines serve" -}}
{{- end -}}
{{- $_ := set $cfg "router_id" (printf "%s-%d" $full (int .ordinal)) -}}
{{- $_ := set $cfg "listen" (printf "0.0.0.0:%d" (int $v.containerPort)) -}}
{{- $_ := set $cfg "model" $v.model -}}
{{- $dns := dig "dns" list ($v.discovery | default dict) -}}
{{- if $dns -}}
{{- $discovery := dict "dns" $dns -}}
{{- if hasKey $v.discovery "interval_s" -}}{{- $_ := set $discovery "interval_s" $v.discovery.interval_s -}}{{- end -}}
{{- if hasKey $v.discovery "grace_s" -}}{{- $_ := set $discovery "grace_s" $v.discovery.grace_s -}}{{- end -}}
{{- $_ := set $cfg "discovery" $discovery -}}
{{- else if $v.engines -}}
{{- $_ := set $cfg "engines" $v.engines -}}
{{- else -}}
{{- fail "give the fleet: engines (a static list) or discovery.dns (headless Services)" -}}
{{- end -}}
{{- $_ := set $cfg "admin" (dict "token_env" "NARWHAL_ADMIN_TOKEN") -}}
{{- $controller := deepCopy (get $cfg "controller" | default dict) -}}
{{- if hasKey $controller "config_watch_interval_s" -}}
{{- fail "config.controller.config_watch_interval_s is set by the chart; use configChange.watchIntervalSeconds" -}}
{{- end -}}
{{- $mode := include "narwhal.configChange" $root -}}
{{- if eq $mode "reload" -}}
{{- $_ := set $controller "config_watch_interval_s" $v.configChange.watchIntervalSeconds -}}
{{- $_ := set $cfg "controller" $controller -}}
{{- end -}}
{{- if eq (include "narwhal.leaseBackend" $root) "etcd" -}}
{{- if not (dig "lease" "endpoints" list $cfg) -}}
{{- fail "config.lease.endpoints is required with config.lease.backend etcd (the routers' shared etcd)" -}}
{{- end -}}
{{- $standby := deepCopy (get $cfg "standby" | default dict) -}}
{{- if hasKey $standby "active_url" -}}
{{- fail "config.standby.active_url is set by the chart: each router of the pair watches the other" -}}
{{- end -}}
{{- $peer := sub (sub $replicas 1) (int .ordinal) -}}
{{- $_ := set $standby "active_url" (printf "http://%s-%d.%s.%s.svc.%s:%d" $full $peer (include "narwhal.headless" $root) $root.Release.Namespace $v.clusterDomain (int $v.containerPort)) -}}
{{- $_ := set $cfg "standby" $standby -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}


{{/* configChange.mode, checked: reload (in place, the default) or restart. */}}
{{- define "narwhal.configChange" -}}
{{- $change := .Values.configChange | default dict -}}
{{- $mode := get $change "mode" | default "reload" -}}
{{- if not (has $mode (list "reload" "restart")) -}}
{{- fail (printf "configChange.mode must be reload or restart, got %q" $mode) -}}
{{- end -}}
{{- if and (eq $mode "reload") (le (float64 (get $change "watchIntervalSeconds" | default 0)) 0.0) -}}
{{- fail "configChange.watchIntervalSeconds must be a number of seconds > 0 with configChange.mode reload" -}}
{{- end -}}
{{- $mode -}}
{{- end -}}

{{/*
What a reload cannot apply (docs/membership.md#config-reload; src/narwhal/control/reload.py):
a router's narwhal YAML without the keys a reload applies in place (model, engines, logging,
auth, TLS files, recovery, and serving and engine but for the keys that size what was built at
start). With configChange.mode reload the pod template carries its checksum, so a change of
one of these rolls the pods and every other change is reloaded in place.
*/}}
{{- define "narwhal.restartConfig" -}}
{{- $cfg := fromYaml (include "narwhal.routerConfig" (dict "root" . "ordinal" 0)) -}}
{{- $cold := omit $cfg "model" "engines" "logging" "auth" "tls" "recovery" "serving" "engine" -}}
{{- $_ := set $cold "serving" (pick (get $cfg "serving" | default dict) "workers" "max_connections" "queue_limit" "max_body_bytes" "token_count_cache_size") -}}
{{- $_ := set $cold "engine" (pick (get $cfg "engine" | default dict) "control_connections" "ca_file") -}}
{{- $_ := set $cold "tls_enabled" (not (empty (dig "tls" "cert_file" "" $cfg))) -}}
{{- toYaml $cold -}}
{{- end -}}

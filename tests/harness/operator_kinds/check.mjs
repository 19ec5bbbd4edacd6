// Checks Prometheus Operator and KEDA objects (a JSON array in the file named by argv[2]) two ways:
// 1. the operator's (and KEDA's) CRD schemas, compiled by @kubernetes-models (types, enums, required fields);
// 2. TypeScript's excess-property check against the same models' types, which the CRD schemas cannot do
//    (they allow unknown fields, and the API server drops them in silence): a misspelt field fails here.
// Prints one line per problem and exits 1 if there is any.
import { readFileSync, writeFileSync, mkdtempSync, rmSync } from "node:fs";
import { join, dirname } from "node:path";
import { execFileSync } from "node:child_process";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const OPERATOR = "@kubernetes-models/prometheus-operator/monitoring.coreos.com";
const KINDS = {
  "monitoring.coreos.com/v1/PrometheusRule": `${OPERATOR}/v1/PrometheusRule`,
  "monitoring.coreos.com/v1/ServiceMonitor": `${OPERATOR}/v1/ServiceMonitor`,
  "monitoring.coreos.com/v1/PodMonitor": `${OPERATOR}/v1/PodMonitor`,
  "monitoring.coreos.com/v1alpha1/AlertmanagerConfig": `${OPERATOR}/v1alpha1/AlertmanagerConfig`,
  // KEDA's, from its CRDs likewise (docs/scaling.md: the chart's autoscaling.keda).
  "keda.sh/v1alpha1/ScaledObject": "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject",
};
const objects = JSON.parse(readFileSync(process.argv[2], "utf8"));
const problems = [];
const lines = [];
for (const [i, obj] of objects.entries()) {
  const path = KINDS[`${obj.apiVersion}/${obj.kind}`];
  const where = `${obj.kind} ${obj.metadata?.namespace ?? ""}/${obj.metadata?.name ?? "?"}`;
  if (!path) {
    problems.push(`${where}: not a kind this check knows (${obj.apiVersion})`);
    continue;
  }
  const kind = obj.kind;
  const Model = (await import(path))[kind];
  try {
    new Model(obj).validate();
  } catch (err) {
    problems.push(`${where}: ${err.message}`);
  }
  lines.push(`import type { I${kind} as T${i} } from "${path}";`);
  lines.push(`export const o${i}: T${i} = ${JSON.stringify(obj)};`);
}
// Beside node_modules, so that the imports resolve.
const dir = mkdtempSync(join(here, ".check-"));
const source = join(dir, "objects.ts");
writeFileSync(source, lines.join("\n") + "\n");
const tsc = join(here, "node_modules", "typescript", "bin", "tsc");
try {
  execFileSync(process.execPath, [tsc, "--noEmit", "--strict", "--module", "nodenext", "--moduleResolution",
    "nodenext", "--skipLibCheck", source], { encoding: "utf8", cwd: here });
} catch (err) {
  problems.push(...(err.stdout || String(err)).trim().split("\n"));
} finally {
  rmSync(dir, { recursive: true, force: true });
}
for (const line of problems) console.log(line);
console.log(`${objects.length} objects, ${problems.length} problems`);
process.exit(problems.length ? 1 : 0);

// Checks Grafana dashboards (a JSON object {file name: dashboard} in the file named by argv[2]) against
// @grafana/schema, once per Grafana release installed here (package.json), with TypeScript's excess-property
// check: Grafana ignores a key it does not know, in silence, so a misspelt option fails only here.
//
// What is checked against what:
// - the dashboard's shell (its panels taken out) against the schema's Dashboard;
// - each panel's shell against Panel, its `options` against its plugin's Options, and its
//   `fieldConfig.defaults.custom` against the plugin's FieldConfig (Panel types both as open records);
// - each panel's queries, and each annotation against AnnotationQuery with a query as its target, against the
//   Prometheus data source's query. The schema has no types for a data source's queries (Panel.targets is a
//   list of open records), nor for the Prometheus annotation options that its AnnotationQueryEditor keeps on
//   the annotation (titleFormat, tagKeys, textFormat, useValueForTime): PROMETHEUS below declares both, after
//   the data source's PromQuery. That is the one extension of the schema here.
// `__inputs` and `__requires` are what Grafana's import reads, outside the model: they are not checked.
// TypeScript names the first unknown key of each object, so each variable, annotation and panel is an object
// of its own here. Prints one line per problem, naming the release, the dashboard, the panel and the key, and exits 1 if any.
import { readFileSync, writeFileSync, mkdtempSync, rmSync, readdirSync } from "node:fs";
import { join, dirname } from "node:path";
import { execFileSync } from "node:child_process";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const PLUGINS = {
  timeseries: "timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen",
  stat: "stat/panelcfg/x/StatPanelCfg_types.gen",
  table: "table/panelcfg/x/TablePanelCfg_types.gen",
  heatmap: "heatmap/panelcfg/x/HeatmapPanelCfg_types.gen",
  xychart: "xychart/panelcfg/x/XYChartPanelCfg_types.gen",
  "state-timeline": "statetimeline/panelcfg/x/StateTimelinePanelCfg_types.gen",
};
const WITH_FIELD_CONFIG = new Set(["timeseries", "table", "heatmap", "xychart", "state-timeline"]);
// Grafana fills what a dashboard leaves out with its defaults, so every field is optional here (DeepPartial):
// what fails is a key the schema does not name, or a value of the wrong type. A JSON string is never of a
// TypeScript string enum's type, so an enum stands for the strings of its members.
const PROMETHEUS = `
type DeepPartial<T> = T extends string ? \`\${T}\` : T extends (infer U)[] ? DeepPartial<U>[] : T extends object ? { [K in keyof T]?: DeepPartial<T[K]> } : T;
type PrometheusQuery = G.DataQuery & { expr: string; interval?: string; legendFormat?: string;
  format?: "time_series" | "table" | "heatmap"; instant?: boolean; range?: boolean; intervalFactor?: number;
  exemplar?: boolean; editorMode?: "code" | "builder" };
type PrometheusAnnotation = G.AnnotationQuery<PrometheusQuery> & {
  titleFormat?: string; textFormat?: string; tagKeys?: string; useValueForTime?: boolean;
};`;

const boards = JSON.parse(readFileSync(process.argv[2], "utf8"));
const releases = readdirSync(join(here, "node_modules")).filter((n) => n.startsWith("grafana-schema-")).sort();
const problems = [];
if (!releases.length) problems.push("no @grafana/schema installed: run `make grafana-schema` (npm)");

for (const release of releases) {
  const lines = [`import type * as G from "${release}";`];
  const where = {}; // line number -> what it holds
  const used = new Set();
  for (const [name, board] of Object.entries(boards)) {
    const { __inputs, __requires, panels = [], annotations = {}, templating = {}, ...shell } = board;
    const add = (what, type, value) => {
      where[lines.length + 1] = `${name}: ${what}`;
      lines.push(`export const v${lines.length}: DeepPartial<${type}> = ${JSON.stringify(value)};`);
    };
    add("the dashboard", "G.Dashboard", shell);
    for (const variable of templating.list ?? []) add(`variable "${variable.name}"`, "G.VariableModel", variable);
    for (const annotation of annotations.list ?? []) {
      add(`annotation "${annotation.name}"`, "PrometheusAnnotation", annotation);
    }
    for (const panel of panels) {
      const { options, ...rest } = panel;
      const label = `panel "${panel.title}" (${panel.type})`;
      const { targets = [], ...shell } = rest;
      add(label, "G.Panel", shell);
      for (const target of targets) add(`${label} query ${target.refId}`, "PrometheusQuery", target);
      const plugin = PLUGINS[panel.type];
      if (!plugin) {
        problems.push(`${release}: ${name}: ${label}: no schema for the panel type ${panel.type} in this check`);
        continue;
      }
      const alias = `P_${panel.type.replace("-", "_")}`;
      used.add(`import type * as ${alias} from "${release}/dist/esm/raw/composable/${plugin}";`);
      add(`${label} options`, `${alias}.Options`, options ?? {});
      if (WITH_FIELD_CONFIG.has(panel.type)) {
        add(`${label} fieldConfig.defaults.custom`, `${alias}.FieldConfig`, panel.fieldConfig?.defaults?.custom ?? {});
      }
    }
  }
  // The plugin imports go after the first line, so that the recorded line numbers hold: shift them.
  const imports = [...used];
  const shifted = {};
  for (const [line, what] of Object.entries(where)) shifted[Number(line) + imports.length + 1] = what;
  const source = [lines[0], ...imports, PROMETHEUS.replace(/\n/g, " "), ...lines.slice(1)];
  const dir = mkdtempSync(join(here, ".check-"));
  const file = join(dir, "dashboards.ts");
  writeFileSync(file, source.join("\n") + "\n");
  // The plugins' types import "@grafana/schema" itself: this release, not the other.
  const modules = join(here, "node_modules", release);
  const compilerOptions = { strict: true, noEmit: true, module: "esnext", moduleResolution: "bundler",
    skipLibCheck: true, paths: { "@grafana/schema": [modules], "@grafana/schema/*": [`${modules}/*`] } };
  writeFileSync(join(dir, "tsconfig.json"), JSON.stringify({ compilerOptions, files: ["dashboards.ts"] }));
  const tsc = join(here, "node_modules", "typescript", "bin", "tsc");
  try {
    execFileSync(process.execPath, [tsc, "--project", join(dir, "tsconfig.json")], { encoding: "utf8", cwd: here });
  } catch (err) {
    for (const line of (err.stdout || String(err)).trim().split("\n")) {
      const at = /dashboards\.ts\((\d+),(\d+)\): (.*)/.exec(line);
      // TypeScript points at the property it means: its name is the quoted key at that column.
      const key = at && /^"((?:[^"\\]|\\.)*)"/.exec(source[at[1] - 1].slice(at[2] - 1));
      const message = at && at[3].replace(/in type '(.{50}).*'\.$/, "in type '$1…'");  // not the whole type
      if (at) problems.push(`${release}: ${shifted[at[1]] ?? `line ${at[1]}`}: key ${key ? key[1] : "?"}: ${message}`);
      else if (line.trim() && !line.startsWith(" ")) problems.push(`${release}: ${line}`);
      else if (problems.length) problems[problems.length - 1] += ` ${line.trim()}`;
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
for (const line of problems) console.log(line);
console.log(`${Object.keys(boards).length} dashboards, ${releases.join(", ")}: ${problems.length} problems`);
process.exit(problems.length ? 1 : 0);
